"""The optional C part of shoal: numpy arrays of task threads allocated in shared memory
(``shoal/_shmalloc.c``). shoal works without it (results are then copied into shared
memory), so a failed build is not an error."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shoal._shmalloc", ["shoal/_shmalloc.c"], optional=True)])
