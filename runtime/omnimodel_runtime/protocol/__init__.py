"""Wire models: the OpenAI API (:mod:`.openai`) and the internal stage protocol (:mod:`.stage`,
framed by :mod:`.frames`). Pydantic, numpy and the standard library only."""
