"""A model over several devices (``model.device_map``): the settings' start-time checks, and where a dispatched
model computes.

``model.device_map`` is handed to ``from_pretrained`` (accelerate's dispatch): a strategy (``auto``, ``balanced``,
``balanced_low_0``, ``sequential``, bounded per device by ``model.max_memory``) or an explicit {module name:
device} map.  What accelerate then does decides what a run computes:

* the modules mapped to GPUs run on their GPU (their weights live there);
* the modules mapped to ``cpu`` or ``disk`` are *offloaded*: their weights are kept there and brought, for each
  call, to the map's first GPU, which runs them; only a map without any GPU runs on the CPU;
* inputs reach each placed module through accelerate's ``AlignDevicesHook`` (which moves the arguments to the
  module's execution device), and the model's outputs come back to its inputs' device.

So a module's arithmetic runs on a GPU of the map (or on the CPU for a map without one), with the kernels it gets
on one device; every per-layer state of the attention plug-in and the methods follows the layer's own query and
key tensors (``attention.plugin``), and what is gathered across layers (the recorder's sums, the engine's logits,
sampling and stopping) is gathered on one device in a fixed order (the recorder on the host, the engine on
``main_device``).  A run's records are then those of the same model on one device, and the map is no part of a
run's identity (``loading.model_identity``), like the batch size; ``tests/models/test_device_map.py`` checks it for
every registered method.

torch is imported lazily: the checks run in a sweep's preflight before any model loads."""

from __future__ import annotations

from typing import Any, Mapping

DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOAD_DEVICES = ("cpu", "disk")  # a map's entries whose weights are offloaded (run on the map's first GPU)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _valid_devices(count: int) -> list[str]:
    return ["cpu", "disk"] + ([f"0..{count - 1}", f"cuda:0..cuda:{count - 1}"] if count else [])


def _map_device(what: str, value: Any, count: int) -> int | str:
    """One device of an explicit map (or of ``max_memory``) as accelerate takes it: a GPU index (int), ``"cpu"`` or
    ``"disk"``; ``what`` names the setting in the error."""
    dev: int | str | None = None
    if isinstance(value, bool):
        dev = None
    elif isinstance(value, int):
        dev = value if 0 <= value < count else None
    elif isinstance(value, str):
        v = value.strip().lower()
        if v in OFFLOAD_DEVICES:
            dev = v
        elif v == "cuda" and count:
            dev = 0
        elif v.startswith("cuda:") and v[5:].isdigit() and int(v[5:]) < count:
            dev = int(v[5:])
        elif v.isdigit() and int(v) < count:
            dev = int(v)
    if dev is None:
        raise ValueError(
            f"{what}={value!r} is not a device here; valid: {_valid_devices(count)} (cpu and disk hold offloaded "
            f"weights, run on the map's first GPU)"
        )
    return dev


def check_device_map(
    device: str, device_map: Any, max_memory: Any = None, offload_folder: str | None = None
) -> tuple[Any, dict[Any, Any] | None]:
    """Start-time check of ``model.device_map`` / ``model.max_memory`` / ``model.offload_folder`` against
    ``model.device``: returns (the map as ``from_pretrained`` takes it: a strategy name, or {module: GPU index,
    "cpu" or "disk"}; the memory bounds) or (None, None) without a map.  Raises a one-line ValueError naming the
    valid values."""
    if device_map is None:
        for key, val in (("max_memory", max_memory), ("offload_folder", offload_folder)):
            if val is not None:
                raise ValueError(
                    f"model.{key} is only read with model.device_map; set model.device_map="
                    f"{'|'.join(DEVICE_MAP_STRATEGIES)} (or a {{module: device}} map), or drop model.{key}"
                )
        return None, None
    if device != "auto":
        raise ValueError(
            f"model.device={device!r} and model.device_map are both set: give one (model.device=auto with a device "
            f"map, or model.device_map=null to load the whole model on model.device)"
        )
    count = _cuda_count()
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise ValueError(
                f"model.device_map={device_map!r}; valid: {list(DEVICE_MAP_STRATEGIES)} or a {{module name: device}} "
                f"map (e.g. {{model.layers.0: 0, model.layers.1: 1}})"
            )
        dm: Any = device_map
    elif isinstance(device_map, Mapping):
        if not device_map:
            raise ValueError("model.device_map={} places no module; give a strategy (auto, balanced, ...) or a map")
        dm = {}
        for name, value in device_map.items():
            if not isinstance(name, str):
                raise ValueError(f"model.device_map: key {name!r} is not a module name (e.g. model.layers.0)")
            dm[name] = _map_device(f"model.device_map[{name!r}]", value, count)
        if "disk" in dm.values() and not offload_folder:
            raise ValueError(
                "model.device_map puts modules on disk; give model.offload_folder=DIR (where their weights are kept)"
            )
    else:
        raise ValueError(
            f"model.device_map={device_map!r}; valid: {list(DEVICE_MAP_STRATEGIES)} or a {{module name: device}} map"
        )
    mem = None
    if max_memory is not None:
        if not isinstance(max_memory, Mapping) or not max_memory:
            raise ValueError(
                f"model.max_memory={max_memory!r}: give {{device: size}}, e.g. {{0: 70GiB, 1: 70GiB, cpu: 200GiB}}"
            )
        mem = {}
        for key, size in max_memory.items():
            dev = _map_device("a model.max_memory key", key, count)
            if dev == "disk":
                raise ValueError("model.max_memory: disk has no bound; give GPU indices and cpu")
            if isinstance(size, bool) or not isinstance(size, (int, str)) or (isinstance(size, int) and size <= 0):
                raise ValueError(f"model.max_memory[{key!r}]={size!r}: give bytes (an int > 0) or a size like 70GiB")
            mem[dev] = size
    return dm, mem


def map_uses_cuda(device_map: Any) -> bool:
    """Whether a checked map (``check_device_map``) computes on a GPU: a strategy where CUDA is present, an
    explicit map that names a GPU."""
    if isinstance(device_map, str):
        return _cuda_count() > 0
    return any(isinstance(v, int) for v in device_map.values())


def execution_device(module: Any) -> Any:
    """The device ``module`` computes on: its accelerate hook's execution device when it has one (a dispatched
    model's module, offloaded or not), else the device of its first parameter or buffer that is not on ``meta``."""
    import torch

    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        dev = getattr(h, "execution_device", None)
        if dev is not None:
            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def main_device(model: Any) -> Any:
    """Where a model's inputs go and its logits are read (the engine's device): the execution device of its input
    embeddings.  One device for a model on one device; for a dispatched model its embeddings' GPU (the map's first
    GPU when they are offloaded), where the whole model would run on one GPU."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return execution_device(emb if emb is not None else model)


def device_map_of(model: Any) -> dict[str, Any] | None:
    """The map a dispatched model was placed by (``hf_device_map``: {module: GPU index, "cpu" or "disk"}, as
    resolved from a strategy), or None for a model on one device."""
    dm = getattr(model, "hf_device_map", None)
    return {str(k): (v if isinstance(v, (int, str)) else str(v)) for k, v in dm.items()} if dm else None


def offloaded_tensor(model: Any, name: str) -> Any:
    """The value of parameter or buffer ``name`` (e.g. ``model.layers.3.input_layernorm.weight``), also when an
    offloaded module keeps it on ``meta`` between its calls: then the copy in its accelerate hook's weights map
    (on the host or on disk).  Returns a detached tensor on the device it is kept on."""
    import torch

    t = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
    if t.device.type != "meta":
        return t.detach()
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        module = model.get_submodule(".".join(parts[:i])) if i else model
        hook = getattr(module, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            wmap = getattr(h, "weights_map", None)
            rest = ".".join(parts[i:])
            if wmap is not None:
                try:
                    return torch.as_tensor(wmap[rest]).detach()
                except KeyError:
                    continue
    raise ValueError(f"{name} is offloaded (on meta) and no accelerate hook holds its value")
