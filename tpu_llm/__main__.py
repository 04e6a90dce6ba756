import sys

from tpu_llm.cli import main

sys.exit(main())
