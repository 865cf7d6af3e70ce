"""Translation between the OpenAI API and the stage protocol, and orchestration across stages."""
