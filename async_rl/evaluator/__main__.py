import sys

from async_rl.evaluator.service import main

sys.exit(main())
