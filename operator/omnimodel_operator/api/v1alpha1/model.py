"""``spec.model``: where the weights come from and where they are kept."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from omnimodel_operator.api.v1alpha1.base import KubeModel, Quantity, cel


class ModelCache(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.pvc) != has(self.storageClassName)",
                    "model.cache names an existing claim (pvc) or a storage class to create one from "
                    "(storageClassName), one of the two",
                ),
                cel(
                    "!has(self.pvc) || (!has(self.size) && !has(self.accessMode))",
                    "model.cache.size and accessMode describe a claim the operator creates: they need "
                    "storageClassName, not pvc",
                ),
            ]
        }
    )

    pvc: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="An existing PersistentVolumeClaim to keep the weights in. One fetch Job writes the "
        "model's files into it (only the files the stages need); stage pods mount it read-only and wait "
        "for the fetch instead of downloading. Stages on several nodes need it ReadWriteMany.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Create the claim <name>-models from this StorageClass (and delete it with the OmniModel).",
    )
    size: Quantity | None = Field(default=None, description="Size of a created claim. Default 100Gi.")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"] | None = Field(
        default=None,
        description="Access mode of a created claim; default ReadWriteMany. ReadWriteOnce works only with "
        "every stage pod (and the fetch) on one node.",
    )

    @model_validator(mode="after")
    def _one_claim(self) -> ModelCache:
        # The CEL rule above, again, for objects that never went through the API server.
        if (self.pvc is None) == (self.storage_class_name is None):
            raise ValueError(
                "model.cache names an existing claim (pvc) or a storage class to create one from "
                "(storageClassName), one of the two"
            )
        if self.pvc is not None and (self.size is not None or self.access_mode is not None):
            raise ValueError(
                "model.cache.size and accessMode describe a claim the operator creates: "
                "they need storageClassName, not pvc"
            )
        return self


class SecretKey(KubeModel):
    name: str = Field(min_length=1, max_length=253, description="Secret in the OmniModel's namespace.")
    key: str = Field(default="token", min_length=1, description="Key holding the value. Default token.")


class ModelSpec(KubeModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.tokenSecret) || has(self.cache)",
                    "model.tokenSecret reaches only the fetch Job, which needs model.cache; without a cache "
                    "every stage pod would download, and need the token",
                    ".tokenSecret",
                ),
                cel(
                    "(!has(self.tokenSecret) && !has(self.endpoint)) || self.source.startsWith('hf://')",
                    "model.tokenSecret and model.endpoint are for fetching from a Hugging Face hub: they need an "
                    "hf:// source",
                ),
            ]
        }
    )

    source: str = Field(
        min_length=1,
        max_length=512,
        # pvc:// needs a DNS-1123 claim name (it becomes a volume's claimName).
        pattern=r"^((hf|file|tiny)://.+|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?)$",
        description="Where the weights come from: hf://org/name, pvc://claim/path, file:///path, or "
        "tiny://<preset> for random weights built locally from a small config (tests and demos).",
    )
    revision: str | None = Field(
        default=None,
        description="Hub revision (branch, tag or commit). The fetch resolves it to a commit sha "
        "(status.weights.sha); a changed revision fetches again and rolls the stages.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="Model id clients send in the `model` field. Defaults to the source path.",
    )
    cache: ModelCache | None = Field(
        default=None,
        description="Where hf:// weights are kept for every pod (fetched once). Unset: each stage pod "
        "downloads its own files into its own emptyDir at start (again on every restart).",
    )
    token_secret: SecretKey | None = Field(
        default=None,
        description="A Hugging Face token (Secret key) for private or gated repositories; only the fetch "
        "Job's container gets it (HF_TOKEN), never a stage pod or the gateway. With runtime.kind vllm-omni, "
        "which downloads in its own pods, those pods get it.",
    )
    endpoint: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="A Hugging Face mirror to fetch from (HF_ENDPOINT of the fetch Job; of every pod with "
        "runtime.kind vllm-omni), e.g. an on-prem olah.",
    )

    @model_validator(mode="after")
    def _token_needs_cache(self) -> ModelSpec:
        if (self.token_secret is not None or self.endpoint is not None) and not self.source.startswith("hf://"):
            raise ValueError(
                "model.tokenSecret and model.endpoint are for fetching from a Hugging Face hub: they need an "
                "hf:// source"
            )
        if self.token_secret is not None and self.cache is None:
            raise ValueError(
                "model.tokenSecret reaches only the fetch Job, which needs model.cache; without a cache "
                "every stage pod would download, and need the token"
            )
        return self
