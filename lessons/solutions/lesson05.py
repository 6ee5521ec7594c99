"""Reference solutions to lesson 5's exercises (the ring all-reduce). Try them yourself first."""

import numpy as np


def all_gather(comm, chunk):
    """p - 1 steps around the ring: at step s, forward the block that arrived at step s - 1
    (at step 0, your own) and receive the next one from the left, straight into place."""
    p, rank, n = comm.size, comm.rank, chunk.size
    out = np.empty(p * n, chunk.dtype)
    out[rank * n:(rank + 1) * n] = chunk.ravel()
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send_block, recv_block = (rank - step) % p, (rank - step - 1) % p
        comm.sendrecv(out[send_block * n:(send_block + 1) * n], right,
                      out[recv_block * n:(recv_block + 1) * n], left)
    return out


def reduce_scatter(comm, x):
    """p - 1 steps around the ring: at step s, send your partial sum of block (rank - s - 1) % p
    to the right, receive the left neighbour's partial sum of block (rank - s - 2) % p and add
    your own share. After p - 1 steps block `rank` holds every rank's share."""
    p, rank = comm.size, comm.rank
    n = x.size // p
    partial = x.ravel().copy()  # x itself stays as it was
    incoming = np.empty(n, x.dtype)
    right, left = (rank + 1) % p, (rank - 1) % p
    for step in range(p - 1):
        send_block, recv_block = (rank - step - 1) % p, (rank - step - 2) % p
        comm.sendrecv(partial[send_block * n:(send_block + 1) * n], right, incoming, left)
        partial[recv_block * n:(recv_block + 1) * n] += incoming
    return partial[rank * n:(rank + 1) * n].copy()


def ring_shift(comm, x):
    """Even ranks send, then receive; odd ranks receive, then send. Every send then has a
    receiver that is receiving, or soon will be: rank 1 receives first, which frees rank 0,
    and so on around the ring. (With p odd, ranks p - 1 and 0 are both even: rank p - 1's
    send waits until rank 0 is done sending, which rank 1 allows.)"""
    p, rank = comm.size, comm.rank
    if p == 1:
        return x.copy()  # my left neighbour is me
    incoming = np.empty_like(x)
    right, left = (rank + 1) % p, (rank - 1) % p
    if rank % 2 == 0:
        comm.send(x, right)
        comm.recv(incoming, left)
    else:
        comm.recv(incoming, left)
        comm.send(x, right)
    return incoming
