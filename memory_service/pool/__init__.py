"""The KV pool's memory: POSIX shared memory on CPU, one CUDA allocation shared by IPC handle on a GPU."""
