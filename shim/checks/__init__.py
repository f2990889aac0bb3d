"""podshim's checks of the node, the pod and the request, one concern each: the wiring of the
runtime handlers, what containers share, space, stray processes, CRI strings, task states, the
files CRIU's defaults refuse (openfiles, which also fits CRIU's options to them), the bind mounts
a restore must be given (mounts). Each refuses with a clear error before anything is frozen or
created, or confirms afterwards what an operation left (imports nothing: each caller loads only the
check it runs)."""
