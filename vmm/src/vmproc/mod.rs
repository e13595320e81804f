//! A VM in a process of its own: the protocol between the daemon and a VM
//! process ([`proto`], framed by [`wire`]), the VM process's side
//! ([`server`], `corral vmm`), the daemon's launcher of VM processes
//! ([`launcher`]) and its view of one ([`remote::RemoteVm`]).

pub mod adopt;
pub mod hostids;
pub mod launcher;
pub mod nspool;
pub mod proto;
pub mod remote;
pub mod server;
pub mod spawn;
pub mod wire;
