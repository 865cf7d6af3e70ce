"""Files the operator ships into vLLM-Omni pods (through the ``<cr>-pipeline`` ConfigMap); never imported here."""
