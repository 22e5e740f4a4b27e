"""One conformance suite per plugin kind: ``<kind>.py`` defines ``SUITE``."""
