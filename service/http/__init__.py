"""The HTTP edge: the connection (uvicorn's protocol with early refusal and limits), the routes, uploads and keys.
Routes only translate HTTP into the use cases' calls (service/usecases/inference.py)."""
