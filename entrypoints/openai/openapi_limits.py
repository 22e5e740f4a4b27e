"""The served /openapi.json states this server's own limits, so that a body
the schema allows is one the server accepts (what schemathesis checks as
"positive data acceptance"):

- /detokenize's token ids are bounded by this model's vocabulary, not int64;
- without --trust-request-chat-template, `chat_template` and
  `chat_template_kwargs` can only be left out (or `{}`, which asks for
  nothing); with it, the kwargs may not name the renderer's own arguments.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.chat_template import RENDERER_ARGUMENTS

TEMPLATE_REQUEST_MODELS = ("ChatCompletionRequest", "TokenizeRequest")
UNTRUSTED_TEMPLATE = (
    "refused (400) unless the server runs with --trust-request-chat-template: a request's template is code"
)


def state_server_limits(schemas: dict[str, Any], vocab_size: int, trust_request_chat_template: bool) -> None:
    """Narrow the request schemas in `schemas` (the OpenAPI components) to this server's limits."""
    tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
    tokens["items"]["maximum"] = vocab_size - 1
    tokens["description"] = f"ids of this model's vocabulary: 0 to {vocab_size - 1}"
    for name in TEMPLATE_REQUEST_MODELS:
        properties = schemas[name]["properties"]
        if trust_request_chat_template:
            renderer_arguments = {"not": {"enum": sorted(RENDERER_ARGUMENTS)}}
            properties["chat_template_kwargs"]["anyOf"][0]["propertyNames"] = renderer_arguments
            continue
        properties["chat_template"] = {"type": "null", "default": None, "description": UNTRUSTED_TEMPLATE}
        properties["chat_template_kwargs"] = {
            "anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}], "default": None,
            "description": UNTRUSTED_TEMPLATE + " (an empty object asks for nothing and is accepted)",
        }
