"""Text to image on diffusers: the whole pipeline or its encode, denoise and decode stages."""
