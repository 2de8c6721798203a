"""What a tool is given and what it gives back, under veRL's names: the schema of a tool
(:class:`OpenAIFunctionToolSchema`) and the response of a call (:class:`ToolResponse`).

A veRL tool imports both from ``verl.tools.schemas``; here they come from
:mod:`asyncrl.tools`, so a tool ports by changing its imports.

veRL's schema is a pydantic model read by attribute (``self.tool_schema.function.name``);
the tools of this project, the chat template and the pool read the same schema as the
plain dict of the tool config (``tool_schema["function"]["name"]``). The schema here is
both: a dict whose keys read as attributes too, and whose fields veRL gives a default
(``description``, ``strict``, ``enum``...) read as that default when the config leaves them
out. It keeps every key of the config (a property's ``items``, say), where a pydantic
model would drop the ones it does not name; a key named as a dict method (``items``,
``keys``) reads only as ``prop["items"]``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, field_validator

__all__ = [
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class ToolResponse(BaseModel):
    """The answer of one call, as veRL's tools return it from ``execute`` (and, empty, from
    ``create``).

    Attributes:
        text: What the model reads; None is an empty answer, as in veRL's agent loop.
        image: Images (a list); this pool is text-only and passes them on to nobody.
        video: Videos (a list); likewise not passed on.
    """

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @field_validator("image", "video", mode="before")
    @classmethod
    def _a_list(cls, value: Any) -> Any:
        # veRL refuses a bare image (not wrapped in a list) the same way: the mistake is
        # the tool's, and pydantic would otherwise try to read the image as a list.
        if value is not None and not isinstance(value, list):
            raise ValueError(f"must be a list, got {type(value).__name__}; wrap one in [...]")
        return value

    def is_empty(self) -> bool:
        """Whether the response holds nothing: no text, image or video."""
        return not self.text and not self.image and not self.video


_S = TypeVar("_S", bound="_SchemaObject")


class _SchemaObject(dict[str, Any]):
    """A JSON object of a tool schema: a dict whose keys read (and are set) as attributes.

    Subclasses name the fields veRL gives a default (:attr:`_defaults`, read when the key is
    absent and never stored, so the dict stays what the config says) and the class of the
    objects their fields hold (:meth:`_wrap`).
    """

    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, data: Mapping[str, Any] | None = None, /, **fields: Any) -> None:
        super().__init__()
        for key, value in {**(data or {}), **fields}.items():
            self[key] = self._wrap(key, value)

    def _wrap(self, key: str, value: Any) -> Any:
        """``value`` as the field ``key`` holds it (a nested schema object, or as it is)."""
        return value

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails; dunders stay absent so that copy and the
        # serialization protocols see an ordinary dict.
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self:
            return self[name]
        if name in self._defaults:
            return self._wrap(name, copy.deepcopy(self._defaults[name]))
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = self._wrap(name, value)

    @classmethod
    def model_validate(cls: type[_S], obj: Any) -> _S:
        """A schema object from a mapping (copied), as pydantic's ``model_validate``; an
        object of this class is returned as it is.

        Raises:
            TypeError: ``obj`` is not a mapping.
        """
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, Mapping):
            raise TypeError(f"{cls.__name__} needs a mapping, got {type(obj).__name__}")
        return cls(copy.deepcopy(dict(obj)))

    def model_dump(self, *, exclude_none: bool = False, **_options: Any) -> dict[str, Any]:
        """The schema as plain dicts and lists (a copy). Fields the config left out are
        never added, as pydantic's ``exclude_unset=True`` (what veRL dumps with); other
        pydantic options are accepted and change nothing."""
        return _plain(self, exclude_none)

    def model_dump_json(self, *, indent: int | None = None, **options: Any) -> str:
        """:meth:`model_dump` as JSON text."""
        return json.dumps(self.model_dump(**options), indent=indent)


def _plain(value: Any, exclude_none: bool) -> Any:
    """``value`` with every mapping a plain dict and every list a fresh list."""
    if isinstance(value, Mapping):
        return {
            k: _plain(v, exclude_none) for k, v in value.items() if not (exclude_none and v is None)
        }
    if isinstance(value, list | tuple):
        return [_plain(v, exclude_none) for v in value]
    return copy.deepcopy(value)


class OpenAIFunctionPropertySchema(_SchemaObject):
    """One argument of a function (``type``, ``description``, ``enum``, ...)."""

    _defaults: ClassVar[dict[str, Any]] = {"description": None, "enum": None}


class OpenAIFunctionParametersSchema(_SchemaObject):
    """A function's arguments: ``type`` (``object``), ``properties`` (name -> property)
    and ``required`` (names)."""

    _defaults: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}, "required": []}

    def _wrap(self, key: str, value: Any) -> Any:
        if key == "properties" and isinstance(value, Mapping):
            return {
                name: OpenAIFunctionPropertySchema(prop) if isinstance(prop, Mapping) else prop
                for name, prop in value.items()
            }
        return value


class OpenAIFunctionSchema(_SchemaObject):
    """A function: ``name``, ``description``, ``parameters``, ``strict``."""

    _defaults: ClassVar[dict[str, Any]] = {"description": None, "parameters": {}, "strict": False}

    def _wrap(self, key: str, value: Any) -> Any:
        if key == "parameters" and isinstance(value, Mapping):
            return OpenAIFunctionParametersSchema(value)
        return value


class OpenAIFunctionToolSchema(_SchemaObject):
    """A tool's schema in OpenAI's function-calling format (``type: function``,
    ``function``), read as veRL's (``schema.function.name``) or as a dict
    (``schema["function"]["name"]``)."""

    def _wrap(self, key: str, value: Any) -> Any:
        if key == "function" and isinstance(value, Mapping):
            return OpenAIFunctionSchema(value)
        return value
