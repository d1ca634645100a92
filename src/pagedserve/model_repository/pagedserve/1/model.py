# The adapter lives in the installed package (pagedserve.adapters.triton_server); this file only
# makes Triton's Python backend find it. Engine settings: engine.json beside this file.
from pagedserve.adapters.triton_server.model import TritonPythonModel  # noqa: F401
