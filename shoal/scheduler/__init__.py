"""The scheduler: sans-IO state (:mod:`.state`) and its server (:mod:`.server`)."""
