"""Name -> method class.  Adding a method is one new module with ``@register`` plus one config file."""

from __future__ import annotations

from typing import Any, Mapping

from .base import Method, MethodConfig

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def method_class(name: str) -> type[Method]:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; valid methods: {sorted(METHODS)}") from None


def is_dense(name: Any) -> bool:
    """Whether ``name`` is a registered method that computes no selection (``Method.dense``: full attention, the
    reference every other method is compared with); False for a name this process does not know."""
    cls = METHODS.get(name) if isinstance(name, str) else None
    return bool(cls is not None and cls.dense)


def compare_names() -> list[str]:
    """The methods the default experiment compares when ``compare`` is not given: every registered one, the dense
    reference first, then by name."""
    return sorted(METHODS, key=lambda name: (not METHODS[name].dense, name))


def make_config(name: str, options: Mapping[str, Any] | None = None) -> MethodConfig:
    """Build a method's config dataclass from plain options, refusing unknown keys by name."""
    import dataclasses

    cls = method_class(name).config_class
    fields = {f.name for f in dataclasses.fields(cls)}
    opts = dict(options or {})
    opts.setdefault("name", name)
    unknown = sorted(set(opts) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for method {name!r}; valid options: {sorted(fields)}")
    return cls(**opts)


def build_method(config: MethodConfig | Mapping[str, Any]) -> Method:
    if not isinstance(config, MethodConfig):
        config = make_config(config["name"], config)
    return method_class(config.name)(config)
