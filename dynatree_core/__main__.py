import sys

from dynatree_core.cli import main

sys.exit(main())
