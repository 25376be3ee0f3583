# The refstream image: the refresher (`refresh`), the enrichment job (`enrich`, PySpark needs a JRE)
# and the simulator (`python -m demo.simulate`). Used by docker-compose.yml.
FROM python:3.11-slim-bookworm

# Spark 4 runs on Java 17; procps gives Spark's scripts `ps`.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PYSPARK_PYTHON=python3 \
    PYSPARK_DRIVER_PYTHON=python3

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY refstream ./refstream
COPY refresh ./refresh
COPY enrich ./enrich
COPY demo ./demo
# The refresher and the job (the `enrich` extra: PySpark, pandas), at the versions CI tests
# (constraints.txt). The simulator needs nothing more; the embedded broker (`demo` extra) is not needed.
RUN pip install -c constraints.txt '.[enrich]' \
 && python -m enrich compile-pyspark
COPY conf ./conf

# Spark writes scratch files under its working directory and home: both must be writable.
RUN useradd --system --uid 10001 --home-dir /app refstream \
 && mkdir -p /var/lib/refstream \
 && chown refstream /app /var/lib/refstream
USER refstream
VOLUME ["/var/lib/refstream"]
CMD ["refresh", "--help"]
