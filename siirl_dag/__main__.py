import sys

from siirl_dag.main import main

sys.exit(main())
