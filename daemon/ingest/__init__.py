"""HTTP ingest: the ``POST /v1/events`` server (``server``) and the parse/validate seam
(``validate``)."""
