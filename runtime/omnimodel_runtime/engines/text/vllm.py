"""Text generation on vLLM's async engine (``AsyncLLM``), which batches continuously by itself.

The prompt is rendered with the model directory's own tokenizer and chat template (the same code the
transformers adapter uses) and handed to vLLM as token ids, so both engines see identical input.
Outputs stream as ``RequestOutputKind.DELTA``: one chunk per step with the new text and token ids.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, Final

from transformers import AutoTokenizer
from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from omnimodel_runtime.engines.base import Engine, EngineContext
from omnimodel_runtime.engines.devices import resolve_device
from omnimodel_runtime.engines.text.common import GenerationDefaults, ResolvedSampling, render_prompt, resolve_sampling
from omnimodel_runtime.errors import StageError
from omnimodel_runtime.protocol.stage import (
    FinalFrame,
    ResponseFrame,
    SamplingParams,
    StageInput,
    StageRequest,
    TextFrame,
    Usage,
)

log = logging.getLogger(__name__)

# What vLLM needs to run a small model on CPU (docs/reference/PIPELINE-NOTES.md): fp32, eager mode, a short
# context and a KV budget. Stage engine_args override any of these; on GPUs vLLM's own defaults apply.
CPU_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 2048,
}
# The KV budget on CPU, in bytes, unless the stage sets its own (this or gpu_memory_utilization). Not a share
# of memory: vLLM's CPU worker sizes a share as share x the NUMA node's memory minus the worker's own RSS,
# and with 0.05 on a 13.6 GiB node a worker of RSS 0.75 GiB got a negative budget and refused to start (CI).
CPU_KV_CACHE_BYTES: Final = 512 * 1024**2


class VllmTextEngine(Engine):
    """``vllm`` adapter for the ``text-generation`` task."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        self._engine: AsyncLLM | None = None
        self._tokenizer: Any = None
        self._defaults = GenerationDefaults()
        self._max_model_len = 0
        self._vocab_size = 0
        self._waiting = 0

    def engine_args(self) -> dict[str, Any]:
        """Arguments for ``AsyncEngineArgs``: CPU defaults when on CPU, then the stage's engine_args."""
        args: dict[str, Any] = {}
        if resolve_device(self.context.settings.device) == "cpu":
            args.update(CPU_DEFAULTS)
            if not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(self.stage.engine_args):
                args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        args.update(self.stage.engine_args)
        args["model"] = str(self.context.model_dir)
        args.setdefault("disable_log_stats", True)
        return args

    async def start(self) -> None:
        args = self.engine_args()
        # Tokenizer first: the chat template is ours to apply.
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.context.model_dir)
        self._defaults = GenerationDefaults.from_model_dir(self.context.model_dir)
        # Building the engine spawns and waits for its core process (tens of seconds); off the event
        # loop, so /livez keeps answering meanwhile. AsyncLLM starts its output handler lazily on the
        # first request when constructed outside a running loop.
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, AsyncEngineArgs(**args))
        self._engine = engine
        self._max_model_len = int(engine.model_config.max_model_len)
        # vLLM's own rule (renderers/base.py validate_token_ids): an id the tokenizer or the model knows.
        self._vocab_size = max(len(self._tokenizer), int(engine.model_config.get_vocab_size()))
        log.info("Started vLLM for stage %s (%s)", self.stage.name, args)

    async def warmup(self) -> None:
        request = StageRequest(
            request_id=f"warmup-{secrets.token_hex(4)}",
            prompt="Warm up.",
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
        )
        async for _ in self.generate(StageInput(request=request)):
            pass

    async def stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def queue_depth(self) -> int:
        return self._waiting

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len or None

    def _sampling(self, s: ResolvedSampling, *, stream: bool) -> VllmSamplingParams:
        return VllmSamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            ignore_eos=s.ignore_eos,
            # DELTA: each output carries only new tokens; FINAL_ONLY: one output when done.
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, inp: StageInput) -> AsyncIterator[ResponseFrame]:
        engine = self._engine
        if engine is None:
            raise StageError("the engine is not running", status=503, type="service_unavailable")
        request = inp.request
        ids = render_prompt(self._tokenizer, request, vocab_size=self._vocab_size)
        sampling = resolve_sampling(request, self._defaults, prompt_len=len(ids), max_model_len=self._max_model_len)
        prompt = parse_model_prompt(engine.model_config, {"prompt_token_ids": ids})
        try:
            (engine_input,) = await engine.renderer.render_cmpl_async([prompt])
        except (VLLMClientError, ValueError) as err:  # vLLM's input validation: the request's fault
            raise StageError(str(err), status=400) from err
        # vLLM ids must be unique among live requests; a retried gateway request keeps its id.
        request_id = f"{request.request_id}-{secrets.token_hex(4)}"
        completion_tokens = 0
        finished = False
        self._waiting += 1
        first = True
        try:
            async for out in engine.generate(engine_input, self._sampling(sampling, stream=request.stream), request_id):
                if first:
                    self._waiting -= 1
                    first = False
                delta = out.outputs[0]
                completion_tokens += len(delta.token_ids)
                self.context.metrics.add_generated_tokens(len(delta.token_ids))
                yield TextFrame(text=delta.text, token_ids=tuple(delta.token_ids))
                if out.finished:
                    finished = True
                    reason = delta.finish_reason or "stop"
                    yield FinalFrame(reason, Usage(len(ids), completion_tokens))
                    return
        except (VLLMClientError, ValueError) as err:  # vLLM's input validation
            raise StageError(str(err), status=400) from err
        finally:
            if first:
                self._waiting -= 1
            if not finished:
                # Closing vLLM's generator aborts too; this covers a close between two outputs.
                await engine.abort(request_id)
