"""Routing policies: where a request goes among data-parallel engines (the
`router` plugin kind; the interface is routers/base.py)."""
