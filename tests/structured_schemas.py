"""JSON Schemas of real-world shape for the structured-output tests and benchmark.

Nested objects, arrays with minItems/maxItems, enums, integer and number ranges, required and optional
properties, $defs/$ref, anyOf, string patterns and formats. Free-text strings (and the date-time) carry
a maxLength, numbers a multipleOf (cents, a tenth of a degree) and the tree a bounded depth, as API
schemas usually do: a sampling model at temperature 1.0 may otherwise write one string, the digits of
one number, or ever deeper nesting until max_tokens.
`validate` checks a value the way the tests and the benchmark do.
"""

from __future__ import annotations

from fractions import Fraction

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "address": {
        "type": "object",
        "properties": {
            "street": NAME, "city": NAME,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"type": "string", "enum": ["US", "FR", "DE", "JP"]},
        },
        "required": ["street", "city", "zip", "country"],
    },
    "product": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.01},
            "in_stock": {"type": "boolean"},
        },
        "required": ["sku", "price", "in_stock"],
    },
    "tags": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    "rgb": {
        "type": "object",
        "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
        "required": ["r", "g", "b"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
        },
        "required": ["label", "score"],
    },
    "event": {
        "type": "object",
        "properties": {"title": NAME, "date": {"type": "string", "format": "date"},
                       "attendees": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["title", "date"],
    },
    "user_account": {
        "type": "object",
        "properties": {
            "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "active": {"type": "boolean"},
        },
        "required": ["username", "role"],
    },
    "point_list": {
        "type": "array",
        "items": {"type": "object",
                  "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                 "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                  "required": ["x", "y"]},
        "minItems": 2, "maxItems": 3,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {"type": "array", "minItems": 1, "maxItems": 2,
                      "items": {"type": "object",
                                "properties": {"name": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["name", "qty"]}},
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["order_id", "items", "status"],
    },
    "defs_ref": {
        "$defs": {"money": {"type": "object",
                            "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 1000},
                                           "currency": {"enum": ["EUR", "USD"]}},
                            "required": ["amount", "currency"]}},
        "type": "object",
        "properties": {"subtotal": {"$ref": "#/$defs/money"}, "total": {"$ref": "#/$defs/money"}},
        "required": ["subtotal", "total"],
    },
    "any_of_contact": {
        "type": "object",
        "properties": {"contact": {"anyOf": [
            {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{6,12}$"}},
             "required": ["phone"], "additionalProperties": False},
            {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
             "required": ["email"], "additionalProperties": False},
        ]}},
        "required": ["contact"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"anyOf": [SHORT, {"type": "null"}]}, "id": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9999}},
        "required": ["nickname", "id"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": NAME,
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60, "multipleOf": 0.1},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "temperature_c", "conditions"],
    },
    "book": {
        "type": "object",
        "properties": {
            "title": NAME,
            "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
            "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            "isbn": {"type": "string", "pattern": "^[0-9]{13}$"},
        },
        "required": ["title", "authors", "year"],
    },
    "matrix": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2,
                  "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    },
    "http_request": {
        "type": "object",
        "properties": {
            "method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
            "path": {"type": "string", "pattern": "^/[a-z]{1,8}(/[a-z0-9]{1,8}){0,2}$"},
            "status": {"type": "integer", "minimum": 100, "maximum": 599},
        },
        "required": ["method", "path", "status"],
    },
    "boolean_flags": {
        "type": "object",
        "properties": {k: {"type": "boolean"} for k in ("dark_mode", "beta", "notifications")},
        "required": ["dark_mode", "beta", "notifications"],
        "additionalProperties": False,
    },
    "optional_only": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": SHORT},
        "additionalProperties": False,
    },
    "nested_company": {
        "type": "object",
        "properties": {
            "name": NAME,
            "ceo": {"type": "object", "properties": {"name": NAME, "since": {"type": "integer", "minimum": 1900,
                                                                           "maximum": 2030}},
                    "required": ["name"]},
            "employees": {"type": "integer", "minimum": 1, "maximum": 1000000},
        },
        "required": ["name", "ceo"],
    },
    "enum_array": {
        "type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "minItems": 1, "maxItems": 3,
    },
    "const_version": {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
    },
    "uuid_record": {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}, "label": SHORT},
        "required": ["id"],
    },
    "datetime_log": {
        "type": "object",
        "properties": {"ts": {"type": "string", "format": "date-time", "maxLength": 25},  # no endless fractions
                       "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "msg": NAME},
        "required": ["ts", "level", "msg"],
    },
    "geo": {
        "type": "object",
        "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
                       "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001}},
        "required": ["lat", "lon"],
    },
    "recipe": {
        "type": "object",
        "properties": {
            "name": NAME,
            "ingredients": {"type": "array", "minItems": 1, "maxItems": 3, "items": SHORT},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["name", "ingredients", "minutes"],
    },
    "tool_call": {
        "type": "object",
        "properties": {
            "name": {"enum": ["get_weather", "search", "send_email"]},
            "arguments": {"type": "object", "properties": {"query": SHORT, "limit": {"type": "integer", "minimum": 1,
                                                                                      "maximum": 10}},
                          "required": ["query"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
    },
    "tree_depth3": {  # a tree through $defs/$ref, nesting bounded (an unbounded $ref cycle may never close)
        "$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["v"], "additionalProperties": False},
                  "branch": {"type": "object",
                             "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}}},  # noqa: E501
                             "required": ["v"], "additionalProperties": False}},
        "type": "object",
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/branch"}}},
        "required": ["v"],
    },
    "score_card": {
        "type": "object",
        "properties": {"player": NAME, "scores": {"type": "array", "minItems": 3, "maxItems": 3,
                                                  "items": {"type": "integer", "minimum": 0, "maximum": 10}}},
        "required": ["player", "scores"],
    },
    "one_of_shape": {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1,
                                                                              "maximum": 99}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 99}},
             "required": ["kind", "side"], "additionalProperties": False},
        ],
    },
    "phone_book": {
        "type": "object",
        "properties": {"entries": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"name": NAME, "phone": {"type": "string",
                                                                     "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
            "required": ["name", "phone"]}}},
        "required": ["entries"],
    },
    "type_union": {
        "type": "object",
        "properties": {"value": {"type": ["integer", "boolean", "null"], "minimum": 0, "maximum": 50}},
        "required": ["value"],
    },
}


def _strict(schema):
    """additionalProperties: false on every object that does not say otherwise, as OpenAI's strict
    structured outputs require: without it any key may be added, with a free-text name and value."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


SCHEMAS = {name: _strict(schema) for name, schema in SCHEMAS.items()}


def validate(value, schema) -> None:
    """jsonschema's Draft 2020-12 validation with its format checks, and multipleOf checked exactly: the
    float test (12.3456 / 0.0001 = 123455.99999999999) would refuse numbers that are multiples."""
    import jsonschema

    def multiple_of(validator, step, instance, schema):
        if validator.is_type(instance, "number") and (Fraction(str(instance)) / Fraction(str(step))).denominator != 1:
            yield jsonschema.ValidationError(f"{instance} is not a multiple of {step}")

    base = jsonschema.Draft202012Validator
    exact = jsonschema.validators.extend(base, {"multipleOf": multiple_of})
    exact(schema, format_checker=base.FORMAT_CHECKER).validate(value)
