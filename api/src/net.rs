//! Listening sockets for the HTTP servers on the event path.

use std::net::SocketAddr;

use axum::serve::{Listener, ListenerExt as _};
use tokio::net::{TcpListener, TcpStream};

/// `listener` with Nagle's algorithm off on every accepted connection: a small answer (a 204, a
/// proxied response) leaves at once instead of waiting on the peer's delayed ACK.
pub fn no_delay(listener: TcpListener) -> impl Listener<Io = TcpStream, Addr = SocketAddr> {
    listener.tap_io(|stream| {
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted connection");
        }
    })
}
