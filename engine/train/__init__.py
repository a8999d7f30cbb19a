"""Training the bundled default model, `spark-mini` (recipe and results: resources/models/README.md)."""
