"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shapes: serve a LoRA adapter under a model name
at run time, or stop serving it (requests running under it finish; later ones naming it get a 404)."""

from __future__ import annotations

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.api.protocol import decode_request
from gateway.api.serving import ServerState, as_api_error, read_body
from gateway.engines.client import EngineUnavailableError
from gateway.web import errors


class LoadLoraAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=False):
    lora_name: str | None = None
    lora_path: str | None = None

    def validate(self) -> None:
        if not self.lora_name or not self.lora_path:
            raise errors.invalid_request("Both 'lora_name' and 'lora_path' must be provided.")


class UnloadLoraAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=False):
    lora_name: str | None = None

    def validate(self) -> None:
        if not self.lora_name:
            raise errors.invalid_request("'lora_name' needs to be provided to unload a LoRA adapter.")


async def load_lora_adapter(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), LoadLoraAdapterRequest)
    name, path = req.lora_name, req.lora_path
    async with state.lora_lock:  # one update at a time: a name is loaded, or not, everywhere
        if name in state.adapters or name == state.model_name:
            raise errors.invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            result = await state.client.load_lora(name, path)
        except EngineUnavailableError as e:
            raise as_api_error(e) from None
        if result.error is not None:
            raise errors.invalid_request(result.error, "lora_path")
        state.adapters[name] = path
        state.metrics.add_model(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request, state: ServerState) -> Response:
    req = decode_request(await read_body(request), UnloadLoraAdapterRequest)
    name = req.lora_name
    async with state.lora_lock:
        if name not in state.adapters:
            raise errors.lora_not_found(name)
        del state.adapters[name]  # first: no request naming it goes to the engine from now on
        try:
            result = await state.client.unload_lora(name)
        except EngineUnavailableError:
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")  # a new engine lacks it
        if result.error is not None and not result.not_found:
            raise errors.invalid_request(result.error, "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
