"""The inference core, transport-neutral: a request's life (`inference`), what is admitted (`admission`), the
per-process state (`state`), image preparation and result encoding, domain errors and metrics."""
