"""Text generation: prompt rendering and sampling shared by the transformers and vLLM adapters."""
