"""``horovodrun`` for the test harness: Horovod's own launcher (``run_commandline``, the code
behind the ``horovodrun`` script), without its per-launch probe of the build.

Before it starts any rank, ``horovodrun --gloo`` forks a child that imports
``horovod.torch`` (and with it torch) only to ask whether Gloo was built: 1.8 s on one core
here, in each of the suite's ~100 Gloo launches. ``make setup`` asked once
(``horovodrun --check-build``); ``tests/test_comm.py`` checks the answer again in every run.
The launch scripts' tests (launch/local.sh, launch/elastic.sh, the two hosts, the GPU dry
run) start the real ``horovodrun``, probe included."""
import sys

from horovod.runner import launch

if __name__ == "__main__":
    launch.gloo_built = lambda verbose=False: True
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())
