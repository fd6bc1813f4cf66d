"""When this process began importing the offline package (wall clock): imported first by the package, before the
modules that pull in torch, so a scorer actor can tell its imports apart from its scheduling."""

import time

IMPORT_STARTED_AT = time.time()
