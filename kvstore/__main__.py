"""``python -m pdserve.kvstore ...`` runs the daemon (same flags as ``pdserve kvstore``)."""

from pdserve.kvstore.cli import main

raise SystemExit(main())
