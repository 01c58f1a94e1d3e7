"""What the tests ask of the warm pool (:mod:`intralayer.ranks`) beyond running jobs."""
import multiprocessing.forkserver

import psutil


def alive() -> list:
    """The ranks of this process's pool still running (the fork server's children): none between jobs."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    try:
        return psutil.Process(pid).children(recursive=True) if pid else []
    except psutil.NoSuchProcess:
        return []
