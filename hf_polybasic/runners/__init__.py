"""How one model of a chain runs its forwards: with a `DynamicCache` (`dynamic`), a preallocated,
compiled cache (`static`), both on the shared half in `base`; recurrent state (`recurrent`); the
attention kernels they use and the probe that chooses between them (`probe`)."""
