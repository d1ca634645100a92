"""`python -m pagedserve.kernels.cpu`: build the C++ CPU kernels now (scripts/setup.sh runs it)."""

import sys

from pagedserve.kernels.cpu.build import main

sys.exit(main())
