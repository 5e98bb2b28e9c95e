"""HTTP routers: `classify` (/v1/classify*), `open_inference` (KServe v2), `operations` (/v1/model, /metrics)."""
