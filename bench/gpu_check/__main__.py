import sys

from bench.gpu_check.main import main

sys.exit(main())
