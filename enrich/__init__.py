"""The enrichment job: device events from Kafka joined with reference dimensions kept current from
their changelog topics, written to Kafka, Parquet or the console."""
