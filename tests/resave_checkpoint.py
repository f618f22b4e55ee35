"""Resume a run and write its newest checkpoint again at once, for tests/test_sharded.py: what is written is the state
exactly as this process count loaded it (run under torchrun for several processes).

    python tests/resave_checkpoint.py RUN PARALLEL
"""

import sys

from difftransformer.training.config import resume_config
from difftransformer.training.loop import Trainer

run, parallel = sys.argv[1], sys.argv[2]
trainer = Trainer(resume_config(run, parallel=parallel, threads=1), resume=True, quiet=True)
try:
    trainer.save()
finally:
    trainer.close()
