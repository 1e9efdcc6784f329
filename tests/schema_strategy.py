"""Hypothesis strategies from the JSON Schema subset FastAPI publishes in its OpenAPI document.

Covers objects (properties / required / additionalProperties), arrays, strings, numbers,
integers, booleans, null, enum / const, anyOf / oneOf and local ``$ref``s — enough to generate
well-typed request bodies for every endpoint.  Optional properties are sometimes left out, and
bounds are honoured, so most bodies pass schema validation and reach the handlers' own checks.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def from_schema(schema: dict[str, Any], root: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return st.deferred(lambda: from_schema(node, root, depth + 1))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root, depth) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    # JSON Schema 2020-12: exclusiveMinimum / exclusiveMaximum are the bounds themselves
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    if kind == "integer":
        low = -(1 << 40) if lo is None else int(lo) + ("exclusiveMinimum" in schema)
        high = (1 << 40) if hi is None else int(hi) - ("exclusiveMaximum" in schema)
        full = st.integers(min_value=low, max_value=high)
        if low <= 4 <= high:  # small values too, so ids often fall inside a toy vocabulary
            return st.integers(min_value=max(low, 0), max_value=min(high, 6)) | full
        return full
    if kind == "number":
        return st.floats(
            min_value=lo, max_value=hi, exclude_min=lo is not None and "exclusiveMinimum" in schema,
            exclude_max=hi is not None and "exclusiveMaximum" in schema, allow_nan=False, allow_infinity=False,
        )
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 30), 30)))
    if kind == "array":
        items = schema.get("items", {})
        max_items = min(schema.get("maxItems", 8), 8 if depth < 3 else 2)
        min_items = min(schema.get("minItems", 0), max_items)
        return st.lists(from_schema(items, root, depth + 1), min_size=min_items, max_size=max_items)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional)
    return st.none() | st.integers() | st.text(max_size=10)
