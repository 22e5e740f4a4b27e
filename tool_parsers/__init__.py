"""Tool-call parsers (plugin kind ``tool_parser``): turn a model's text into
OpenAI ``tool_calls`` for ``tool_choice="auto"``. The interface is in
``base``; built-in: ``hermes``."""
