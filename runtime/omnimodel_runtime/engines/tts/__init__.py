"""Text to speech: the SpeechT5 acoustic stage and the HiFi-GAN vocoder stage (transformers)."""
