"""Workers: sans-IO state (:mod:`.state`) and the server that drives it (:mod:`.server`)."""
