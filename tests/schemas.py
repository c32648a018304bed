"""JSON schemas the structured-output tests of the engine and of the server send."""
from __future__ import annotations


def demo_schemas() -> list[dict]:
    """Fifty-odd schemas of every kind a client sends: nested objects, arrays, enums, bounded numbers, anyOf,
    optional fields, references; strings and numbers' digits bounded, so that a small model's outputs end within
    max_tokens (a fraction's digits are a model's to run on: a multipleOf exact in binary bounds them)."""
    leaves = [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": -5, "maximum": 500},
              {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}, {"type": "boolean"},
              {"enum": ["red", "green", "blue"]},
              {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
              {"type": "string", "pattern": "^[a-z]{2,5}$"}, {"const": "fixed"}]
    schemas = []
    for i in range(56):
        a, b, c = leaves[i % 8], leaves[(i // 8 + i) % 8], leaves[(3 * i + 1) % 8]
        props = {"a": a, "b": b if i % 3 else {"type": "array", "items": b, "maxItems": 3},
                 "c": c if i % 4 else {"type": "object", "properties": {"x": c, "y": a}, "required": ["x"]}}
        schema = {"type": "object", "properties": props, "required": ["a", "b", "c"][:1 + i % 3]}
        if i % 7 == 0:
            schema = {"$defs": {"item": schema}, "type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}
        schemas.append(schema)
    return schemas
