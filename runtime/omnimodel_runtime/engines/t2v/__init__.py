"""Text to video (diffusers WanPipeline)."""
