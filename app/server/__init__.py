"""The local OpenAI-compatible server the app can run on the loaded model (engine.openai), and its switches."""
