//! The echo exchange over real TCP on loopback: a token comes back, and every way it can go
//! wrong is an error naming the server.
use std::time::Duration;

use calix_probe::echo::{self, EchoError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[tokio::test]
async fn a_token_comes_back_and_failures_name_the_server() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(echo::serve(listener));
    let rtt = echo::exchange(addr, "calix-probe 1 pod-a 0", Duration::from_secs(5))
        .await
        .expect("echoed");
    assert!(rtt < Duration::from_secs(5));
    server.abort();

    // A server that answers something else.
    let liar = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let liar_addr = liar.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut s, _) = liar.accept().await.expect("accept");
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf).await;
        let _ = s.write_all(b"someone else\n").await;
    });
    let e = echo::exchange(liar_addr, "token", Duration::from_secs(5))
        .await
        .expect_err("mismatch");
    assert!(matches!(e, EchoError::Mismatch { .. }), "{e}");
    assert!(e.to_string().contains(&liar_addr.to_string()), "{e}");

    // A server that never answers.
    let mute = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mute_addr = mute.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let (s, _) = mute.accept().await.expect("accept");
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(s);
    });
    let e = echo::exchange(mute_addr, "token", Duration::from_millis(300))
        .await
        .expect_err("timeout");
    assert!(matches!(e, EchoError::Timeout { .. }), "{e}");
    held.abort();

    // Nobody listening.
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let closed_addr = closed.local_addr().expect("addr");
    drop(closed);
    let e = echo::exchange(closed_addr, "token", Duration::from_secs(5))
        .await
        .expect_err("refused");
    assert!(matches!(e, EchoError::Connect { .. }), "{e}");
}

#[tokio::test]
async fn the_server_drops_an_overlong_line() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(echo::serve(listener));
    let long = "x".repeat(echo::MAX_LINE + 10);
    let e = echo::exchange(addr, &long, Duration::from_secs(5))
        .await
        .expect_err("not echoed");
    assert!(
        matches!(e, EchoError::Mismatch { .. } | EchoError::Io { .. }),
        "{e}"
    );
    server.abort();
}
