"""Pipeline parallelism: the model cut into contiguous stages, a runner that executes a schedule's
actions on one stage, the schedules as data, and a simulator that plays them without MPI."""
