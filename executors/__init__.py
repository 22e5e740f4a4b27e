"""Executors: what starts the workers that run the model (one per rank) and
relays each step to them. A plugin kind (``register_executors``); the
built-in ``uni`` runs one worker in the engine's own process."""
