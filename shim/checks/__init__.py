"""podshim's checks of the node, the pod and the request, one concern each: the wiring of the
runtime handlers, what containers share, space, stray processes, CRI strings, task states. Each
refuses with a clear error before anything is frozen or created, or confirms afterwards what an
operation left (imports nothing: each caller loads only the check it runs)."""
