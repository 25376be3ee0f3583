"""The embedded demo (``make demo``): broker, reference database, refresher, enrichment job and
simulator on one machine, with an operator changing reference data and timing each change."""
