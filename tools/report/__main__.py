"""``python -m tools.report``: see :mod:`tools.report`."""

from tools.report.generate import main


raise SystemExit(main())
