"""What each rank computes, as data: layouts (which tokens a rank holds, block tasks per ring step),
masks (documents, causal, sliding windows) and views of the same schedule for strategies that hold
several shards at once. Pure host-side planning: no communication, no kernels."""
