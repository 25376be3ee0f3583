"""bench.tools.jfr: reading `jfr print`'s samples and putting each in its phase."""

from __future__ import annotations

from bench.tools.jfr import parse, phase

TEXT = """\
jdk.ExecutionSample {
  startTime = 13:08:56.701
  sampledThread = "Executor task launch worker for task 3.0 in stage 1.0 (TID 5)" (javaThreadId = 34)
  state = "STATE_RUNNABLE"
  stackTrace = [
    org.apache.spark.sql.execution.arrow.ArrowFieldWriter.write(SpecializedGetters, int) line: 92
    org.apache.spark.sql.execution.python.PythonArrowInput.writeNextInputToStream(DataOutputStream) line: 120
    ...
  ]
}

jdk.ExecutionSample {
  startTime = 13:08:56.702
  sampledThread = "refresh progress" (javaThreadId = 35)
  state = "STATE_RUNNABLE"
  stackTrace = [
    scala.collection.immutable.List.foreach(Function1) line: 333
  ]
}
"""


def test_parse_gives_each_samples_thread_and_frames_innermost_first() -> None:
    got = list(parse(TEXT.splitlines(keepends=True)))
    assert got == [
        ("Executor task launch worker for task 3.0 in stage 1.0 (TID 5)",
         ["org.apache.spark.sql.execution.arrow.ArrowFieldWriter.write",
          "org.apache.spark.sql.execution.python.PythonArrowInput.writeNextInputToStream"]),
        ("refresh progress", ["scala.collection.immutable.List.foreach"]),
    ]


def test_a_sample_counts_in_the_innermost_phase_not_in_its_caller() -> None:
    frames = ["org.apache.spark.sql.execution.arrow.ArrowFieldWriter.write",
              "org.apache.spark.sql.execution.python.PythonArrowInput.writeNextInputToStream"]
    assert phase(frames) == "rows to Arrow batches (to Python)"
    assert phase(frames[1:]) == "Python runner (hand-off, threads)"
    assert phase(["scala.collection.immutable.List.foreach"]) == "other"


def test_a_sample_counts_in_its_innermost_phase_even_below_a_stream_read() -> None:
    # Spark 4 computes a Python worker's input while reading its output: the read is far above the work.
    frames = ["jdk.internal.math.FloatingDecimal$BinaryToASCIIBuffer.dtoa",
              "org.apache.spark.sql.catalyst.json.JacksonGenerator.writeFields",
              "org.apache.spark.sql.execution.arrow.ArrowWriter.write",
              "java.io.BufferedInputStream.fill"]
    assert phase(frames) == "JSON output (to_json)"
    assert phase(frames[2:]) == "rows to Arrow batches (to Python)"
    assert phase(frames[3:]) == "Python I/O (sockets, streams)"
