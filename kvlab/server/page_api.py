"""The JSON API behind the page's four views (/api/*): thin routes over ``views`` and the bridge.

Planner and crossover sweeps are plain CPU work, so they run in FastAPI's thread pool (sync
routes) and never stall token streaming. The step-through runs the served model, so one runs at a
time and its size is capped: it is a lesson, not a second serving path. With --api-key every
route here needs the key, as /v1 does (``kvlab.server.auth``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from kvlab.catalog import BUNDLED, entries, model_files
from kvlab.dtypes import KV_DTYPES, WEIGHT_DTYPES
from kvlab.hardware import get_device, gpu_names
from kvlab.server.auth import require_api_key
from kvlab.server.bridge import EngineBridge
from kvlab.server.errors import APIError
from kvlab.server.views import crossover_view, eviction_view, plan_view, resolve_spec, step_through
from kvlab.spec import ConfigError, ModelSpec

router = APIRouter(prefix="/api", dependencies=[Depends(require_api_key)])
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B"
MAX_STEP_TOKENS = 48  # the no-cache run is quadratic: keep a click well under a second
_step_lock = threading.Lock()


class ModelChoice(BaseModel):
    """A catalogue model (by name or alias) or a pasted config.json (a JSON object)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=200)
    config: dict[str, Any] | None = None
    kv_dtype: str = "bf16"
    weights_dtype: str = "auto"  # as `kvlab plan`: the checkpoint's quantization_config, else bf16
    gpu: str = "h100-sxm"


class PlanBody(ModelChoice):
    context: int = Field(8192, ge=1, le=100_000_000)
    users: int = Field(1, ge=1, le=1_000_000)
    gpus: int = Field(1, ge=1, le=4096)
    tp: int | None = Field(None, ge=1, le=4096)  # None: all the GPUs


class CrossoverBody(ModelChoice):
    context: int = Field(8192, ge=1, le=16_777_216)
    batch: int = Field(8, ge=1, le=65_536)


class StepsBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=2000)
    max_tokens: int = Field(12, ge=1, le=MAX_STEP_TOKENS)


def _bridge(request: Request) -> EngineBridge:
    return request.app.state.bridge


def _spec(body: ModelChoice) -> ModelSpec:
    """The chosen model's spec; a config.json the reader cannot use is the client's 400."""
    try:
        return resolve_spec(body.model, body.config)
    except (ConfigError, ValueError, KeyError, TypeError) as e:
        raise APIError(f"config.json: {e}", param="config" if body.config is not None else "model") from None


@router.get("/options")
def options(request: Request) -> dict:
    """What the pickers offer, and what the server is serving."""
    b = _bridge(request)
    cap = b.engine.capacity
    gpus = [{"key": k, "name": get_device(k).name if k != "cpu" else "this machine (CPU)"} for k in gpu_names()]
    return {
        "models": [{"id": name, "alias": f"{name} (bundled)"} for name in BUNDLED]
        + [{"id": m.name, "alias": f"{m.name} (installed)", "path": str(path)} for m, path in model_files()
           if m.name not in BUNDLED]
        + [{"id": e.hf_id, "alias": e.alias} for e in entries().values()],
        "default_model": DEFAULT_MODEL, "gpus": gpus, "kv_dtypes": list(KV_DTYPES),
        "weights_dtypes": list(WEIGHT_DTYPES),
        "served": {"id": b.model_id, "max_model_len": b.max_model_len, "block_size": cap.block_size,
                   "num_blocks": cap.blocks, "kv_bytes_per_token": cap.bytes_per_token,
                   "kv_dtype": cap.kv_dtype, "max_concurrency": cap.max_concurrency},
    }


@router.post("/plan")
def plan(body: PlanBody, request: Request) -> dict:
    return plan_view(_spec(body), body.context, body.users, body.kv_dtype, body.weights_dtype, body.gpu,
                     body.gpus, body.tp, _bridge(request).cpu_compute)


@router.post("/crossover")
def crossover(body: CrossoverBody, request: Request) -> dict:
    return crossover_view(_spec(body), body.context, body.batch, body.kv_dtype, body.weights_dtype, body.gpu,
                          _bridge(request).cpu_compute)


@router.post("/steps")
def steps(body: StepsBody, request: Request) -> dict:
    b = _bridge(request)
    b.refuse_if_shutting_down()
    with _step_lock:
        return step_through(b.engine.model, b.tokenizer, body.prompt, body.max_tokens, b.model_id)


class EvictBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=4000)
    budget: int = Field(32, ge=2, le=512)


@router.post("/evict")
def evict(body: EvictBody, request: Request) -> dict:
    b = _bridge(request)
    b.refuse_if_shutting_down()
    with _step_lock:  # runs the served model, like the step-through: one at a time
        return eviction_view(b.engine.model, b.tokenizer, body.prompt, body.budget)


@router.get("/cache")
async def cache(request: Request) -> dict:
    """The live block pool, read on the engine thread between two steps (a consistent view)."""
    b = _bridge(request)
    return await asyncio.wait_for(b.call(b.block_map), timeout=10)
